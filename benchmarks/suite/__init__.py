"""benchmarks/gpu_suite.py by role: `common` (sizes, inputs, checks, the recorder, child
processes), one module per section (`correctness`, `attention_timings`, `model_timings`,
`cudnn_window`, `peers`, `sweep`), `report` (the merged JSON, markdown and PNG) and `runner` (the
budget and the child processes)."""
