"""Entry points for RL frameworks that own their own loop: verl's checkpoint-engine registry
(:mod:`rlplacement.integrations.verl`) and Miles' external weight-transfer protocol
(:mod:`rlplacement.integrations.miles`). Each imports its framework only when imported itself."""
