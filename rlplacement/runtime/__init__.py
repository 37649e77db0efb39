"""Ray actors that run the trainer side of a placed job."""
