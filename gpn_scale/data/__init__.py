"""Reading prepared MDS datasets: opened fast and safely when several jobs start at once on a node
(`streams`), each index checked first (`data_prep.mds_index`). Prep (`data_prep`) writes what this reads."""
