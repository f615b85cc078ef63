"""Observability while training runs: metrics sinks, progress, throughput/MFU, stragglers, hang triage, forensics."""
