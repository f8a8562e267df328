"""The training half: the round loop, its local steps, optimizers, settings and runs on cached features."""
