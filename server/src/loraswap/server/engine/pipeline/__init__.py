"""The resident pipeline: its start-up phases (startup.py), the runtime they make (runtime.py), and the helpers
only it uses (compile, compile cache, attention, quantization, warm-up, CPU threads, previews, target layers)."""
