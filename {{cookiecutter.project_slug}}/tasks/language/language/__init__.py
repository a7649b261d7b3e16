"""The language task's helpers: its tokenizers (bytes, or a BPE trained by prepare_data.py) and
the Hugging Face GPT-2 conversion (--init_from, export.py --format hf). model.py, dataset.py
and the scripts import them; yours to change with them."""
