"""Reading prepared MDS datasets: each dataset's index checked before MosaicML Streaming trusts it
(`mds_index`, also used by prep when it writes one), and datasets opened fast and safely when
several jobs start at once on a node (`streams`). Prep (`gpn_scale.prep`) writes what this reads."""
