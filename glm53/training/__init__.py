"""Training: the built-in corpus (data/) and the trainer behind
`python -m glm53 train` (cli.py parses, trainer.py runs setup / resume / step / log / save, state.py writes and
reads training checkpoints). The losses live in glm53.losses. Import the trainer from its module
(`glm53.training.trainer`)."""
