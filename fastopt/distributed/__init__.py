"""Layouts, batched collectives and the ZeRO wrapper."""
