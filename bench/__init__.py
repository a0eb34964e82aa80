"""Benchmarks: each compares side by side in one run and reports medians and spread."""
