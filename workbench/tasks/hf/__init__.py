"""Hugging Face models: the built-in tasks `hf-causal-lm` and `hf-sequence-classification`, and how
a transformers model is read, fed and cut.

- task.py: what both tasks share (their options, the model, the tokenizer, LoRA), HFTask
- causal_lm.py: `hf-causal-lm`, next-token prediction on packed windows
- classification.py: `hf-sequence-classification`, a label per text
- sources.py: a model folder or an architecture name, loaded safely (no hub, no remote code, no
  pickle)
- text.py: the dataset read with `datasets`, the tokenizer (trained with `tokenizers` on request),
  the tokenization cache shared by the ranks and the runs
- lora.py: LoRA adapters through peft
- stages.py: pipeline stages cut along the model's base_model_pp_plan

transformers, datasets, tokenizers and peft (the `hf` extra) are imported inside functions:
importing this package costs nothing until a task is built.
"""
