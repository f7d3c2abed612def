"""The experiment framework: a composed Hydra config in, a trained and measured run out
(``lessmem.experiment.train.run``)."""
