"""Dense FedAvg of a plain MADE: the learner (device) and the strategy (server)."""
