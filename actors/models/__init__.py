"""Target and drafter models."""
