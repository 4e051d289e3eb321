"""Attacks on text models: TAG, LAMP, DAGER (decoder and encoder) and the text imprint, with the span checks
they share."""
