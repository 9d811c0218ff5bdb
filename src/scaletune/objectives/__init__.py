"""Training objectives: SFT and the preference losses (DPO, IPO, ORPO, KTO, SimPO) over a batch, with their metrics."""
