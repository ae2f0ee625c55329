//! How layers of a node's TOML config combine: the one rule shared by the
//! node (a profile under the file) and the testnet (a scenario's per-node
//! settings over its `node_config`), so that both read a layered config the
//! same way.

/// Lay `top` over `base`: tables merge key by key, any other value of `top`
/// (arrays included) replaces `base`'s.
pub fn merge_tables(base: &mut toml::Table, top: toml::Table) {
    for (key, value) in top {
        match (base.get_mut(&key), value) {
            (Some(toml::Value::Table(b)), toml::Value::Table(t)) => merge_tables(b, t),
            (_, v) => {
                base.insert(key, v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_merge_key_by_key_and_other_values_are_replaced() -> anyhow::Result<()> {
        let mut base: toml::Table = toml::from_str(
            "a = 1\nlist = [1, 2]\n[t]\nx = 1\ny = 2\n[t.deep]\nk = \"base\"\nkeep = true\n[only_base]\nz = 3\n",
        )?;
        let top: toml::Table =
            toml::from_str("a = 10\nlist = [9]\nnew = \"n\"\n[t]\ny = 20\n[t.deep]\nk = \"top\"\n[only_top]\nw = 4\n")?;
        merge_tables(&mut base, top);
        let want: toml::Table = toml::from_str(
            "a = 10\nlist = [9]\nnew = \"n\"\n[t]\nx = 1\ny = 20\n[t.deep]\nk = \"top\"\nkeep = true\n\
             [only_base]\nz = 3\n[only_top]\nw = 4\n",
        )?;
        assert_eq!(base, want);
        // A table replaces a scalar and a scalar a table.
        let mut base: toml::Table = toml::from_str("a = 1\n[b]\nx = 1\n")?;
        merge_tables(&mut base, toml::from_str("b = 2\n[a]\ny = 2\n")?);
        assert_eq!(base, toml::from_str::<toml::Table>("b = 2\n[a]\ny = 2\n")?);
        Ok(())
    }
}
