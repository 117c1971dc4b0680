"""The demo corpora's record builders (records.py: pretraining, SFT, DPO, RLAIF, KTO; agent.py: tool-call rows),
imported by dataset/demo_data.py's record_builder when a stage's demo file is first built. Imports dataset/ only."""
