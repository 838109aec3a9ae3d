"""Searching the design space on top of generation and prediction: the precision-plan search."""
