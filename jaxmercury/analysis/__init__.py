"""Static analysis of schedules: communication plans, layouts, collectives and memory, with no tracing."""
