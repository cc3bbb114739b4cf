"""Tests of the `analyse` stage."""
