"""How a run's numbers change over its iterations: the learning rate (``learning_rate``) and the
batch size and training length in samples (``samples``). Pure Python over the config's values;
the config's checks and the training loop both read them, so they sit below both."""
