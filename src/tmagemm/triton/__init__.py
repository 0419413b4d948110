"""Triton backends: one file per kernel family, each with its configs, kernel and launcher."""
