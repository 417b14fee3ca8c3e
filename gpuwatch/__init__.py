"""gpuwatch: watch and police GPUs shared by containers."""

__version__ = "0.1.0"
