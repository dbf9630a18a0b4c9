"""Helpers of scripts/bench.py, one concern per module, dependencies flowing one way:
config -> theory -> counting -> impls -> worker -> runner -> aggregate -> report."""
