"""Tests of moelab.report."""
