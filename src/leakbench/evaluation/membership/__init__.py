"""Trials on a trained model's published weights: membership inference with reference models, DP audits,
reconstruction from weights, and the membership verdicts."""
