"""The edge before every route: tokens and who may act, the policy, the Host/Origin guard."""
