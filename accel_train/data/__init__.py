"""Data: where rows come from (sources.py: files, the hub, built-in sets), what a row is (formats.py: chat turns,
prompt/response, alpaca, text; templates and masks), and how they reach the loop (pipeline.py: splits, samplers
balanced over ranks, packing and collation)."""
