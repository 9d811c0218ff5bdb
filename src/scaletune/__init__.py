"""scaletune: fine-tune large language models with one YAML file, from one CPU to many GPUs."""

__version__ = "0.1.0"
