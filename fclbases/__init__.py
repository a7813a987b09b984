"""Shared bases a method may build on: the layer between ``methods`` and ``fclcore``.

Method packages may import it and never import each other, so what two methods share lives
here, method-neutral: ``made`` (the MADE learner loop, checkpoint, evaluation, the options
every MADE method has, the decomposed layers), ``fedavg`` (the dense FedAvg learner and
strategy: a variant such as FedAvgM is a subclass), ``minilm`` (the frozen MiniLM backbone,
Enhancer groups, the prototype selector: what FedET trains and the text-groups export
serves) and ``update_checks``.  Nothing here names a method.
"""
