"""Training runs the trials build on: a model trained under a defense (utility), several seeds trained
together, and FedAvg runs whose checkpoints the rounds of a sweep attack."""
