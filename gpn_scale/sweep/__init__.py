"""Scaling sweeps: size models to target parameter counts, run them, fit scaling laws."""
