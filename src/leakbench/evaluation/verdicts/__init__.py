"""Verdicts from the store's rows: the statistics, the strongest attack S_D, utility and its loss, the verdict
rules, the rounds table and adaptive replication."""
