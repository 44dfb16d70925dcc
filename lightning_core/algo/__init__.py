"""LightningRL: credit assignment (episode -> actions -> tokens), advantages and losses."""
