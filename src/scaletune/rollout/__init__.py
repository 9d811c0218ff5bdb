"""Generation for online objectives (GRPO): engines that sample completions, and the rollout that scores them and builds the rows a step trains on."""
