"""Target and drafter models: configs, checkpoint loading, the decoder and its fused layers."""
