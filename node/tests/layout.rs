//! The layout of `node/src` is part of the architecture (see "What may
//! import what" in `docs/architecture.md`). This test reads the sources and
//! checks the rules, so that a change that breaks them fails here:
//! - `policy/` is pure: no `tokio::` or `libp2p::`, and it imports nothing
//!   of the node outside `policy/`;
//! - `handles/` imports only `policy/` and other handles;
//! - an actor imports no other actor, only handles;
//! - the modules of each crate of the workspace (`node`, `models`,
//!   `protocol`, `testnet`) import each other without a cycle;
//! - no function of `node/src` or `testnet/src` runs past
//!   [`MAX_FUNCTION_LINES`] lines (test modules left out).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A source file as a module path: `actors/net.rs` -> `actors::net`,
/// `policy/mod.rs` -> `policy`, `lib.rs` -> `` (the crate root).
fn module_of(rel: &Path) -> String {
    let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    let last = parts.pop().unwrap_or_default();
    let stem = last.trim_end_matches(".rs");
    if stem != "mod" && stem != "lib" && stem != "main" {
        parts.push(stem.to_string());
    }
    parts.join("::")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            rust_files(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    Ok(())
}

/// The code of a file without comments and without its `#[cfg(test)]`
/// items (tests may use what they like).
fn code_of(text: &str) -> String {
    let code: String = text
        .lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = String::new();
    let mut rest = code.as_str();
    while let Some(i) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..i]);
        rest = &rest[i + "#[cfg(test)]".len()..];
        // Skip the item: up to its `;`, or its matching closing brace.
        let mut depth = 0usize;
        let mut end = rest.len();
        for (j, c) in rest.char_indices() {
            match c {
                ';' if depth == 0 => {
                    end = j + 1;
                    break;
                }
                '{' => depth += 1,
                '}' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        end = j + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

/// Every module of this crate that `code` names through `crate::`, resolved
/// to the longest known module path. `crate::{...}` groups are expanded.
fn imports(code: &str, modules: &BTreeSet<String>) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + "crate::".len()..];
        let paths: Vec<String> = if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            group[..end].split(',').map(|s| s.trim().to_string()).collect()
        } else {
            let end = rest.find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':')).unwrap_or(rest.len());
            vec![rest[..end].to_string()]
        };
        for path in paths {
            let segs: Vec<&str> = path.split("::").filter(|s| !s.is_empty()).collect();
            let resolved = (1..=segs.len()).rev().map(|n| segs[..n].join("::")).find(|m| modules.contains(m));
            if let Some(m) = resolved {
                found.insert(m);
            }
        }
    }
    found
}

struct Crate {
    /// module path -> (file, code)
    files: BTreeMap<String, (PathBuf, String)>,
    /// module path -> the modules it imports (itself excluded)
    graph: BTreeMap<String, BTreeSet<String>>,
}

/// This crate, `node`.
fn load() -> Crate {
    load_crate("node")
}

/// A crate of the workspace by its folder: `node`, `models`, ...
fn load_crate(folder: &str) -> Crate {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..").join(folder).join("src");
    let mut paths = Vec::new();
    rust_files(&src, &mut paths).unwrap_or_else(|e| panic!("{folder}/src is not readable: {e}"));
    let mut files = BTreeMap::new();
    for p in paths {
        let rel = p.strip_prefix(&src).expect("under src").to_path_buf();
        let text = std::fs::read_to_string(&p).expect("source is UTF-8");
        files.insert(module_of(&rel), (rel, code_of(&text)));
    }
    let modules: BTreeSet<String> = files.keys().cloned().collect();
    let graph = files
        .iter()
        .map(|(m, (_, code))| {
            let mut deps = imports(code, &modules);
            deps.remove(m);
            (m.clone(), deps)
        })
        .collect();
    Crate { files, graph }
}

fn in_folder(module: &str, folder: &str) -> bool {
    module == folder || module.starts_with(&format!("{folder}::"))
}

#[test]
fn the_sources_are_found() {
    let c = load();
    for m in ["policy::sync", "policy::placement", "handles::net", "actors::net", "actors::worker", "node"] {
        assert!(c.files.contains_key(m), "module {m} not found; the layout test reads the wrong folder");
    }
    // The parser sees imports: the wiring module imports every actor.
    assert!(c.graph["node"].contains("actors::aggregator"));
}

#[test]
fn top_level_holds_only_wiring() {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src");
    let top: Vec<_> = std::fs::read_dir(&src)
        .expect("node/src is readable")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == "rs"))
        .collect();
    assert!(top.len() <= 8, "node/src has {} files at the top; keep them in folders: {top:?}", top.len());
}

#[test]
fn policy_is_pure() {
    let c = load();
    for (m, (file, code)) in c.files.iter().filter(|(m, _)| in_folder(m, "policy")) {
        for banned in ["tokio::", "libp2p::"] {
            assert!(!code.contains(banned), "{} uses {banned}: policy must stay free of it", file.display());
        }
        for dep in &c.graph[m] {
            assert!(in_folder(dep, "policy"), "{} imports crate::{dep}: policy imports only policy", file.display());
        }
    }
}

#[test]
fn handles_import_only_policy_and_handles() {
    let c = load();
    for (m, (file, _)) in c.files.iter().filter(|(m, _)| in_folder(m, "handles")) {
        for dep in &c.graph[m] {
            assert!(
                in_folder(dep, "policy") || in_folder(dep, "handles"),
                "{} imports crate::{dep}: a handle may import only policy and other handles",
                file.display()
            );
        }
    }
}

#[test]
fn actors_reach_each_other_only_through_handles() {
    let c = load();
    for (m, (file, _)) in c.files.iter().filter(|(m, _)| in_folder(m, "actors") && m.as_str() != "actors") {
        for dep in &c.graph[m] {
            assert!(
                !in_folder(dep, "actors") && dep != "node" && !in_folder(dep, "cmd"),
                "{} imports crate::{dep}: an actor imports handles, policy, ops and config, never another actor \
                 or the wiring",
                file.display()
            );
        }
    }
}

/// The first import cycle in `graph`, as a path that ends where it starts.
fn find_cycle<'a>(graph: &BTreeMap<&'a str, Vec<&'a str>>) -> Option<Vec<&'a str>> {
    // Depth-first search; 1: on the stack, 2: done.
    fn visit<'a>(
        m: &'a str,
        graph: &BTreeMap<&'a str, Vec<&'a str>>,
        state: &mut BTreeMap<&'a str, u8>,
        stack: &mut Vec<&'a str>,
    ) -> Option<Vec<&'a str>> {
        match state.get(m) {
            Some(2) => return None,
            Some(1) => {
                let start = stack.iter().position(|s| *s == m).unwrap_or(0);
                let mut cycle = stack[start..].to_vec();
                cycle.push(m);
                return Some(cycle);
            }
            _ => {}
        }
        state.insert(m, 1);
        stack.push(m);
        for d in graph.get(m).into_iter().flatten() {
            if let Some(cycle) = visit(d, graph, state, stack) {
                return Some(cycle);
            }
        }
        stack.pop();
        state.insert(m, 2);
        None
    }
    let mut state = BTreeMap::new();
    graph.keys().find_map(|m| visit(m, graph, &mut state, &mut Vec::new()))
}

/// The crates whose modules must import each other without a cycle.
const CRATES: [&str; 4] = ["node", "models", "protocol", "testnet"];

#[test]
fn modules_import_each_other_without_a_cycle() {
    for folder in CRATES {
        let c = load_crate(folder);
        assert!(c.files.len() > 3, "{folder}/src has only {} files: the test reads the wrong folder", c.files.len());
        let graph: BTreeMap<&str, Vec<&str>> =
            c.graph.iter().map(|(m, deps)| (m.as_str(), deps.iter().map(String::as_str).collect())).collect();
        if let Some(cycle) = find_cycle(&graph) {
            panic!("import cycle in {folder}/src: {}", cycle.join(" -> "));
        }
    }
}

/// The longest a function of `node/src` or `testnet/src` may be, from its
/// `fn` line to its closing brace: past this, split it into named pieces.
const MAX_FUNCTION_LINES: usize = 100;

/// `line` with the contents of its string and character literals blanked
/// (so that a `{` in a string is not a brace) and its `//` comment cut.
/// `in_string` carries an unclosed `"` string over to the next line; raw
/// strings with `#`s are taken as plain strings, which is enough for brace
/// counting.
fn blank_literals(line: &str, in_string: &mut bool) -> String {
    let chars: Vec<char> = line.chars().collect();
    let mut out = String::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if *in_string {
            match c {
                '\\' => i += 1,
                '"' => {
                    *in_string = false;
                    out.push('"');
                }
                _ => {}
            }
        } else if c == '"' {
            *in_string = true;
            out.push('"');
        } else if c == '/' && chars.get(i + 1) == Some(&'/') {
            break;
        } else if c == '\'' {
            // A char literal ('x', '\n', '{'), not a lifetime ('a).
            let end = if chars.get(i + 1) == Some(&'\\') {
                chars[i + 2..].iter().position(|&c| c == '\'').map(|p| i + 2 + p)
            } else if chars.get(i + 2) == Some(&'\'') {
                Some(i + 2)
            } else {
                None
            };
            match end {
                Some(e) => {
                    out.push_str("' '");
                    i = e;
                }
                None => out.push(c),
            }
        } else {
            out.push(c);
        }
        i += 1;
    }
    out
}

/// The functions of a source file, test items left out, with their length
/// in lines, from the `fn` line to the closing brace.
fn function_lengths(text: &str) -> Vec<(String, usize)> {
    let mut in_string = false;
    let blanked: Vec<String> = text.lines().map(|l| blank_literals(l, &mut in_string)).collect();
    let code = code_of(&blanked.join("\n"));
    let lines: Vec<&str> = code.lines().collect();
    let mut out = Vec::new();
    for (start, line) in lines.iter().enumerate() {
        let Some(name) = fn_name(line) else { continue };
        let mut depth = 0i64;
        let mut opened = false;
        'scan: for (j, l) in lines[start..].iter().enumerate() {
            for c in l.chars() {
                match c {
                    '{' => {
                        depth += 1;
                        opened = true;
                    }
                    '}' => depth -= 1,
                    ';' if !opened && depth == 0 => break 'scan, // a declaration without a body
                    _ => {}
                }
                if opened && depth == 0 {
                    out.push((name.clone(), j + 1));
                    break 'scan;
                }
            }
        }
    }
    out
}

/// The name of the function declared on `line`, if one is.
fn fn_name(line: &str) -> Option<String> {
    let mut words = line.split_whitespace().peekable();
    while let Some(w) = words.next() {
        match w {
            "fn" => {
                let name = words.next()?;
                let end = name.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(name.len());
                return (end > 0).then(|| name[..end].to_string());
            }
            "pub" | "async" | "const" | "unsafe" | "extern" | "default" => {}
            w if w.starts_with("pub(") => {}
            _ => return None,
        }
    }
    None
}

#[test]
fn no_function_is_too_long() {
    let mut long = Vec::new();
    for folder in ["node", "testnet"] {
        let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..").join(folder).join("src");
        let mut paths = Vec::new();
        rust_files(&src, &mut paths).unwrap_or_else(|e| panic!("{folder}/src is not readable: {e}"));
        assert!(paths.len() > 3, "{folder}/src has only {} files: the test reads the wrong folder", paths.len());
        for path in paths {
            let text = std::fs::read_to_string(&path).expect("source is UTF-8");
            for (name, n) in function_lengths(&text) {
                if n > MAX_FUNCTION_LINES {
                    let rel = path.strip_prefix(&src).unwrap_or(&path).display().to_string();
                    long.push(format!("{folder}/src/{rel}: fn {name} has {n} lines"));
                }
            }
        }
    }
    assert!(
        long.is_empty(),
        "functions over {MAX_FUNCTION_LINES} lines (split them into named pieces):\n{}",
        long.join("\n")
    );
}

#[test]
fn function_lengths_are_measured_from_fn_to_its_closing_brace() {
    let text = "pub(crate) async fn a(x: u32) -> u32 {\n    let s = \"{ not a brace // http://x\";\n    \
                let c = '{'; // }\n    x\n}\n\
                trait T {\n    fn decl(&self);\n    fn with_body<'a>(&'a self) {\n        if true { }\n    }\n}\n\
                fn multi(\n    y: u8,\n) {\n}\n#[cfg(test)]\nmod tests {\n    fn long_test() {\n    }\n}\n";
    let got = function_lengths(text);
    let want: Vec<(String, usize)> = vec![("a".into(), 5), ("with_body".into(), 3), ("multi".into(), 4)];
    assert_eq!(got, want);
}

#[test]
fn the_checks_see_imports_and_cycles() {
    // The checks above are only as good as the import parser and the cycle
    // search: feed them code and a graph with a known answer.
    let modules: BTreeSet<String> =
        ["actors::net", "handles::net", "policy::sync", "policy"].iter().map(|s| s.to_string()).collect();
    let code = code_of(
        "use crate::handles::net::{NetworkHandle, Routes};\nuse crate::{policy::sync::SyncPolicy, actors::net};\n\
         // use crate::nothing::here;\n#[cfg(test)]\nmod tests { use crate::x; fn g() {} }\nfn f() { crate::actors::net::spawn(); }",
    );
    let found = imports(&code, &modules);
    let want: BTreeSet<String> =
        ["handles::net", "policy::sync", "actors::net"].iter().map(|s| s.to_string()).collect();
    assert_eq!(found, want);

    let mut graph: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    graph.insert("a", vec!["b"]);
    graph.insert("b", vec!["c"]);
    graph.insert("c", vec![]);
    assert_eq!(find_cycle(&graph), None);
    graph.insert("c", vec!["a"]);
    assert_eq!(find_cycle(&graph), Some(vec!["a", "b", "c", "a"]));
}
