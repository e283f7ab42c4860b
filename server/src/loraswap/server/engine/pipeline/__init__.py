"""The resident pipeline: its start-up phases (startup.py, the warm-up in warm_up.py), the runtime they make
(runtime.py), and the helpers only it uses (compile, compile cache, attention, quantization, warm-up shapes, CPU
threads, previews, target layers)."""
