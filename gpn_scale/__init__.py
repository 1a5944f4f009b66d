"""gpn-scale: a training system for Grounded Prediction Networks (GPN / GPN+M)."""

__version__ = "0.1.0"
