"""Networks: the catalog, the user's factories, and the checks and fixes DP training needs."""
