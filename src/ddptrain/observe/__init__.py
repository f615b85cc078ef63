"""Observability: metrics sinks, progress, throughput/MFU, stragglers, hang triage, reports, the doctor."""
