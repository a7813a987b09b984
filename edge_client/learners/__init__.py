"""Device-side halves of learning methods, registered under the scenario's ``method`` name.

Importing this package registers every built-in method.
"""

from edge_client.learners.base import LEARNERS, Learner, make_learner, register
from edge_client.learners import decomposed, fedavg, fedet  # noqa: F401  (register their methods)

__all__ = ["LEARNERS", "Learner", "make_learner", "register"]
