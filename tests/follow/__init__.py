"""Tests of the `follow` stage."""
