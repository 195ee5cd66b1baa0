"""The main job and what it trains on, all offline: `corpus` (the text the package ships), `data` (a tokenizer
trained on it, LM blocks, tiny Llama configs, asset files for stock scripts) and `train` (the main job,
`python -m accelerate_roundpipe.tiny.train`). The examples and the integration tests read `data` too.
"""
