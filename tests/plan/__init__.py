"""Tests of the `plan` stage."""
