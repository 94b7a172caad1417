"""Tests of the benchmarks' own logic (accounting, the files they write), never of their timings."""
