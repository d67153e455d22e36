"""What the three services share: server bootstrap, settings, error mapping, common conversions."""
