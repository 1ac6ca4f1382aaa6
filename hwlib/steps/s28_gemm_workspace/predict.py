"""Nothing this step removes is counted by the roofline: the prediction row says so."""


def predict(ctx):
    return None
