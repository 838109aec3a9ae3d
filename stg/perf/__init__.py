"""What the predictors share: system descriptions (presets and files) and kernel tables."""
