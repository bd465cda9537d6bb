"""Hardware descriptions shared by every cost estimate: the device catalog and the collective model."""
