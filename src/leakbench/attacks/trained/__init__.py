"""Attacks on trained weights (KKT reconstruction, univariate, membership) register here."""
