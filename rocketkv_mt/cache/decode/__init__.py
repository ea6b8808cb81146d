"""Decode policies: how one decode query attends over the set its prefill policy chose."""
