//! The checks of the groups: names and routes beside the upstreams', members that resolve
//! without a cycle, and every upstream without a route reached through some group.

use std::collections::HashMap;

use super::{cooldown, plain_name, BadField, Invalid, RESERVED_ROUTES};
use crate::config::{Config, GroupConfig};

/// Groups: names distinct from every upstream's and group's, routes distinct from every
/// upstream's, members that name an upstream or a group, no group reaching itself, no upstream
/// twice in a group, and every upstream without a route reached through some group.
pub(super) fn validate_groups<'a>(
    config: &'a Config,
    routes: &mut HashMap<&'a str, &'a str>,
) -> Result<(), Invalid> {
    let upstreams: HashMap<&str, usize> = config
        .upstreams
        .iter()
        .enumerate()
        .map(|(i, u)| (u.name(), i))
        .collect();
    let mut groups: HashMap<&str, usize> = HashMap::new();
    for (i, g) in config.groups.iter().enumerate() {
        let at = |bad: BadField| Invalid {
            span: Some(g.name.span()),
            key: format!("group[{i}].{}", bad.field),
            reason: bad.reason,
        };
        validate_group_name(config, i, g, &upstreams, &mut groups, routes).map_err(at)?;
        validate_group_settings(g).map_err(at)?;
    }
    let mut reached = vec![false; config.upstreams.len()];
    for (i, g) in config.groups.iter().enumerate() {
        validate_group_members(config, i, g, &upstreams, &groups, &mut reached)?;
    }
    validate_reached(config, &reached)
}

/// A group's name and route: a plain name that no upstream or earlier group holds (recorded in
/// `groups` at index `i`), and a route of its own that is not an admin endpoint's unless
/// `admin_listen` moves those.
fn validate_group_name<'a>(
    config: &Config,
    i: usize,
    g: &'a GroupConfig,
    upstreams: &HashMap<&str, usize>,
    groups: &mut HashMap<&'a str, usize>,
    routes: &mut HashMap<&'a str, &'a str>,
) -> Result<(), BadField> {
    plain_name(g.name()).map_err(|reason| BadField::new("name", reason))?;
    if upstreams.contains_key(g.name()) || groups.insert(g.name(), i).is_some() {
        return Err(BadField::new(
            "name",
            format!(
                "duplicate name `{}` (groups and upstreams share one namespace)",
                g.name()
            ),
        ));
    }
    if let Some(other) = routes.insert(g.route(), g.name()) {
        return Err(BadField::new(
            "route",
            format!("duplicate route `{}` (also used by `{other}`)", g.route()),
        ));
    }
    if config.admin_listen.is_none() && RESERVED_ROUTES.contains(&g.route()) {
        return Err(BadField::new(
            "route",
            format!("route `{}` is reserved for corral's admin endpoints; set `admin_listen` to move them", g.route()),
        ));
    }
    Ok(())
}

/// A group's own settings: at least one member, shares within (0, 1], a cool-down of 1 s to
/// 24 h, and repeatable paths that are path endings.
fn validate_group_settings(g: &GroupConfig) -> Result<(), BadField> {
    if g.members.is_empty() {
        return Err(BadField::new(
            "members",
            "a group needs at least one member".into(),
        ));
    }
    if !(g.fallback_wait > 0.0 && g.fallback_wait <= 1.0) {
        return Err(BadField::new(
            "fallback_wait",
            format!(
                "`fallback_wait` is a share of the deadline, within (0, 1]; got {}",
                g.fallback_wait
            ),
        ));
    }
    if !(g.hedge_max_ratio > 0.0 && g.hedge_max_ratio <= 1.0) {
        return Err(BadField::new(
            "hedge_max_ratio",
            format!(
                "`hedge_max_ratio` is a share of the group's requests, within (0, 1]; got {}",
                g.hedge_max_ratio
            ),
        ));
    }
    cooldown("cooldown", g.cooldown.0).map_err(|reason| BadField::new("cooldown", reason))?;
    if let Some(bad) = g
        .repeatable_paths
        .iter()
        .find(|p| p.is_empty() || p.contains(char::is_whitespace))
    {
        return Err(BadField::new(
            "repeatable_paths",
            format!(
                "`repeatable_paths` holds path endings such as \"/chat/completions\"; got {bad:?}"
            ),
        ));
    }
    Ok(())
}

/// Group `i`'s members: each names an upstream or a group, `model` only on an upstream, no
/// cycle through nested groups, and no upstream twice. Marks in `reached` every upstream the
/// group resolves to.
fn validate_group_members(
    config: &Config,
    i: usize,
    g: &GroupConfig,
    upstreams: &HashMap<&str, usize>,
    groups: &HashMap<&str, usize>,
    reached: &mut [bool],
) -> Result<(), Invalid> {
    let at = |reason: String| Invalid {
        span: Some(g.name.span()),
        key: format!("group[{i}].members"),
        reason,
    };
    for m in &g.members {
        let known = upstreams.contains_key(m.name()) || groups.contains_key(m.name());
        if !known {
            return Err(at(format!(
                "member `{}` names no upstream or group",
                m.name()
            )));
        }
        if m.model().is_some() && !upstreams.contains_key(m.name()) {
            return Err(at(format!(
                "`model` applies to an upstream member; `{}` is a group",
                m.name()
            )));
        }
    }
    // Depth-first through nested groups: a group met again on the current path is a cycle.
    let mut path = vec![g.name()];
    let mut flat = Vec::new();
    walk(config, groups, g, &mut path, &mut flat).map_err(&at)?;
    for (n, name) in flat.iter().enumerate() {
        if flat[..n].contains(name) {
            return Err(at(format!("upstream `{name}` is in the group twice")));
        }
        reached[upstreams[name]] = true;
    }
    Ok(())
}

/// Every upstream without a route of its own is `reached` through some group.
fn validate_reached(config: &Config, reached: &[bool]) -> Result<(), Invalid> {
    for (i, up) in config.upstreams.iter().enumerate() {
        if up.route().is_empty() && !reached[i] {
            return Err(Invalid {
                span: Some(up.name.span()),
                key: format!("upstream[{i}].route"),
                reason: format!(
                    "upstream `{}` has no `route` and is in no group: no request can reach it",
                    up.name()
                ),
            });
        }
    }
    Ok(())
}

/// The upstream names `group` resolves to, in order, or the cycle that prevents it.
fn walk<'a>(
    config: &'a Config,
    groups: &HashMap<&str, usize>,
    group: &'a GroupConfig,
    path: &mut Vec<&'a str>,
    flat: &mut Vec<&'a str>,
) -> Result<(), String> {
    for m in &group.members {
        match groups.get(m.name()) {
            Some(&j) => {
                let inner = &config.groups[j];
                if path.contains(&inner.name()) {
                    path.push(inner.name());
                    return Err(format!(
                        "group `{}` forms a cycle: {}",
                        path[0],
                        path.join(" -> ")
                    ));
                }
                path.push(inner.name());
                walk(config, groups, inner, path, flat)?;
                path.pop();
            }
            None => flat.push(m.name()),
        }
    }
    Ok(())
}
