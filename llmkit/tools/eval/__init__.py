"""Model-quality evaluations: ``llmkit eval ppl`` (perplexity over a text file)."""
