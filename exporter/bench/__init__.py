"""``elx bench``: the side-by-side runs, the peers and the sweeps."""
